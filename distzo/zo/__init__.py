"""Zeroth-order machinery: directions, the trainable-parameter set, estimators."""
