"""python -m examples.mcp [--host 127.0.0.1] [--port 8091]"""

import sys

from .server import main

if __name__ == "__main__":
    sys.exit(main())
