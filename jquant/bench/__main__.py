import sys

from jquant.bench.cli import main

sys.exit(main(sys.argv[1:]))
