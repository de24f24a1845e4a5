"""Seeing inside attention: walkthroughs, tracing and pictures."""
