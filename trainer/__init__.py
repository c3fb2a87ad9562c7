"""trajpipe: trainer package."""
