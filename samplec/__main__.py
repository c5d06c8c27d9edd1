"""`python -m samplec`: the command line (samplec.cli)."""
from samplec.cli import main

if __name__ == "__main__":
    main()
