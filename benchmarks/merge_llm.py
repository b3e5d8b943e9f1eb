"""The merge benchmark on llm 0.36 databases: benchmarks/merge.py --format llm.

Two machines' logs.db files are generated with fixtures.family_llm (llm's own
hashing and part encoding; LogStore.verify() accepts them), then timed as in
merge.py: the raw-SQLite floor, dagsync merge, and re-merge, in one run.
Every option of merge.py applies.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from merge import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--format", "llm", *sys.argv[1:]]))
