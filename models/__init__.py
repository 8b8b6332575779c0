"""Builders of models for tests, demos and planning studies; they need no torch."""
