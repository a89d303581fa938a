import sys

from megak3.inference.cli import main

if __name__ == "__main__":
    sys.exit(main())
