import sys

from difftrain.cli import main

sys.exit(main())
