"""trajpipe: schemas package."""
