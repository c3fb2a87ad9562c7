"""``python -m trajpipe`` == ``trajpipe``."""

from trajpipe.cli import main

if __name__ == "__main__":
    main()
