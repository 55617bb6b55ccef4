"""A stand-in engine program for crash-panel tests: writes a recorded engine log to stderr and exits 1, the
way that engine ended (the command-line arguments it is launched with are ignored)."""

import sys
import time

sys.stderr.write(open(sys.argv[1]).read())
sys.stderr.flush()
time.sleep(0.2)
sys.exit(1)
