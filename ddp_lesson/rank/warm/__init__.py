"""The warm room: every line of the course that forks a process which already imported torch,
and everything such a fork must shed to be what a new interpreter would be. A warm launch's
agent and ranks are forks of warm processes, so what a learner's script sees depends on this
room alone; the private torch and CPython APIs it relies on are listed and checked in one test
(tests/test_warm_fidelity.py, test_every_private_api_the_warm_machinery_uses_is_where_it_was).

- server.py: a warm process (`python -m ddp_lesson.rank.warm.server`): imports torch, waits on
  a socket, forks an agent or a rank per request, notes each child's run (<folder>/<pid>.run).
- ranks.py: in a warm launch's agent, torchrun's rank handler replaced by a request to warm
  process R; `Child`, a Popen-like handle of a forked process.
- fork.py: what a fork sheds (signal dispositions, stdio objects, random state, temporary
  folder, OMP_NUM_THREADS) and which file objects it inherited.

The boundary: the rest of the package uses only these.
    launcher/warm.py   server.fingerprint(), the server's command line and its hello; ranks.request,
                     ranks.Child, ranks.Lost, ranks.Unavailable, ranks.PATHS_ENV
    rank/agent.py    ranks.install(paths)
    rank/guard.py    fork.shed_inheritance() and fork.inherited(obj), in a forked rank only
    rank/procs.py    the notes server.py writes (<folder>/<pid>.run: run_dir, token, start)
This room may use guard.py (the parent ties, reaped(), main), agent.py (main) and rundir.py, nothing else
of the package. Standard library and torch only, like the ranks it starts.
"""
