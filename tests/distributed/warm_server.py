"""Imported last by the forkserver that forks the suite's ranks (launch.PRELOAD): one composition and
check of the tiny configuration, so that what a process pays at its first (Hydra's plugin scan and
override parser, the schemas' registration, the tiny architecture's check: ~0.1 s of CPU) is paid
once in the server rather than in each of the suite's ~600 forked ranks. Nothing of it is a run's
state: Hydra's global state is cleared when the composition ends."""

try:
    from distzo.run.checks import compose_and_check

    compose_and_check(["model=tiny", "task=synthetic-cue"], check_world=False)
except Exception:  # noqa: BLE001  a warm-up only: the ranks meet (and report) any real problem themselves
    pass
