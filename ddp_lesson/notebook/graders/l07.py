"""Notebook 07's exercises: the root cause of a failed run (check_first_failure) and a
boolean command-line flag (check_parser)."""


def check_first_failure(fn, crashed, hung):
    """07: fn(result) is (rank, first line of its message) of a failed run's root cause, from
    its result.json (`crashed`), and None for a run that did not fail with one (`hung`)."""
    got = fn(crashed)
    assert got is not None and got[0] == crashed["failure"]["rank"], \
        f"got {got!r}: the root cause is rank {crashed['failure']['rank']}'s failure"
    assert got[1].strip() == crashed["failure"]["message"].splitlines()[0].strip(), \
        f"got {got!r}: the message's first line, exactly that line"
    assert fn(hung) is None, f"for a run that ended {hung.get('status')} it said {fn(hung)!r}, not None"
    return True


def check_parser(make):
    """07: make() is an ArgumentParser whose --sync-bn is off by default, on with --sync-bn and
    off with --no-sync-bn (not type=bool: bool("False") is True)."""
    p = make()
    assert p is not None, "make_parser() returned None: return the ArgumentParser"
    for argv, want in (([], False), (["--sync-bn"], True), (["--no-sync-bn"], False)):
        try:
            got = p.parse_args(argv).sync_bn
        except SystemExit:
            raise AssertionError(f"the parser refuses {argv}") from None
        assert got is want, f"{argv}: sync_bn is {got!r}, not {want}"
    return True
