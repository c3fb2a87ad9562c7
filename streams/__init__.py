"""trajpipe: streams package."""
