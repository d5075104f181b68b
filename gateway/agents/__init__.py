"""Agent programs between tool calls (issue 36): who a request's program is
(programs.py), how long its tool calls last (gaps.py), and the context held for it on
its replica while it is in one (reserve.py)."""
