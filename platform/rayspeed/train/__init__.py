"""Launching jobs (Ray Train or in-process) and the worker loop."""
