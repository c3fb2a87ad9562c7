"""trajpipe command line and shared settings (no domain logic lives here)."""

__version__ = "0.1.0"
