"""What every grader shares: the one verdict a learner sees, "correct!" or "not yet:".

    run_dir, passed = attempt("work/ex_set_epoch.py", check_set_epoch)   # launch, wait, grade
    passed = grade(check_cuda_index, cuda_index)                          # a function you wrote
"""
from ...launcher import launch, runs


def attempt(script, check, nproc=None, timeout=300):
    """Launch `script` on CPU ranks, wait, run `check` on its run directory and print the
    verdict. Returns (run_dir, passed)."""
    run = launch.start(script, nproc=nproc, cpu=True, timeout=timeout)
    run.wait()
    return run.run_dir, grade(check, run.run_dir)


def grade(check, *answer):
    """Print the verdict of check(*answer) and return whether it passed: "correct!" (and the
    line check returned, if any), or "not yet:" and the sentence of its AssertionError. Any
    other Exception counts as "not yet" too, named by its type: an answer of the wrong kind,
    such as the starter's None (TypeError), or one that raises inside the learner's function
    (a RuntimeError from autograd, say). KeyboardInterrupt and SystemExit are not Exceptions."""
    try:
        said = check(*answer)
    except AssertionError as e:
        print("not yet:", e)
        return False
    except Exception as e:   # the learner's code raised: a verdict, not a traceback
        print(f"not yet: {type(e).__name__}: {e}")
        return False
    print("correct!", *([said] if isinstance(said, str) else []))
    return True


def finished(run_dir):
    """(the run's record, its world size) for a run that ended ok; else AssertionError saying
    how it ended."""
    rec = runs.load(run_dir)     # reads config.json, result.json and the metrics once
    assert rec.status == "ok", f"the run ended {rec.status}: {(rec.result or {}).get('message')}"
    return rec, rec.config["world_size"]
