"""Shared core of every Sluice service.  Imports no service package."""
