import sys

from servematrix.proxy.cli import main

sys.exit(main())
