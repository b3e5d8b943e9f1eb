"""dagsync: one history from the llm CLI's SQLite logs on many machines.

The library does the work and returns report objects; ``dagsync.cli`` is the
only module that parses arguments, prints or exits.
"""

__version__ = "0.1.0"
