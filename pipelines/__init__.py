"""trajpipe: pipelines package."""
