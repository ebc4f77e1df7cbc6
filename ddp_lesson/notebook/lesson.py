"""Small helpers the notebooks share, so no notebook pastes its own copy.

    from ddp_lesson.notebook.lesson import script, check, verdict, show_diff, show, work_dir

    work_dir()                                  # ./work: where the scripts you edit live
    run = check("ddp_equivalence")              # a check script on CPU ranks, returns at once
    result = verdict(run, "equivalence.json")   # waits, then reads the JSON it wrote
    amp = written(run, "amp.json")              # reads it as soon as it is written (a --then chain)
    show_diff("ddp_basic.py", "work/ddp_syncbn.py")
    show_diff("train_single.py", script("ddp_basic.py"), course=False)  # hides the `# course` lines
    show_diff("train_single.py", script("ddp_basic.py"), course=False, fold="the diff")  # in a closed fold
    show_script(script("ddp_basic.py"), course=False)   # the script itself, without its `# course` lines
    show_script(script("ddp_basic.py"), course=False, fold="the whole script")   # the same, in a closed fold
    show(fig)                                   # display a figure once and close it
    ring = load_script("work/ring_allreduce.py")  # a module you edit, loaded afresh
"""
import difflib
import html
import json
import re
import sys
from collections import Counter
from pathlib import Path

from ..rank import chain, rundir
from ..launcher import launch
from ..rank.bundled import load as load_script, script  # noqa: F401 (the notebooks import them from here)



def work_dir(path="work"):
    """The folder the notebooks' %%writefile cells write into; created if missing, readable
    by this user only (0700: a learner's edited scripts are theirs)."""
    path = Path(path)
    rundir.private_dirs(path)
    path.mkdir(exist_ok=True)   # a file of that name still raises, as before
    return path


def check(name, *args, nproc=None, timeout=600):
    """Start the check script checks/<name>.py on CPU ranks (gloo); returns the launch.Run
    at once. nproc=None: the default CPU rank count (DDP_LESSON_NPROC, else 2; 1 when only one
    core is usable)."""
    return launch.start(script(f"{name}.py"), nproc=nproc, cpu=True, args=args, timeout=timeout)


def verdict(run, filename):
    """Wait for a check run and return the JSON it wrote into its run directory. A run that
    did not end ok raises AssertionError with the run's own message."""
    result = run.wait()
    if result["status"] != "ok":
        raise AssertionError(f"{run.config['label']} ended {result['status']}: {result.get('message')}")
    return json.loads((Path(run.run_dir) / filename).read_text())


def written(run, filename, poll=0.2):
    """Wait until the run has written the JSON file `filename` into its run directory and
    return it, without waiting for the run to end: in a launch that chains several scripts
    (--then), one script's result is there while later ones still run, whatever becomes of
    them. A run that ends without writing it raises AssertionError naming the script it failed
    in and the run's own message. An interrupt stops the run, as in run.wait()."""
    path = Path(run.run_dir) / filename
    try:
        while True:
            ended = run.done()               # before looking: a file written just before the end counts
            if path.is_file():
                try:
                    return json.loads(path.read_text())
                except ValueError:           # rank 0 is still writing it
                    if ended:
                        raise
            elif ended:
                break
            run.wait_done(poll)
    except KeyboardInterrupt:
        run.stop()
        raise
    result = run.result
    scripts = chain.names(run.config)
    where = chain.failed_in(run.config, result.get("failure"))
    launch_name = " --then ".join(scripts)
    raise AssertionError(f"{filename} was not written: the run ({launch_name}) ended {result['status']}"
                         + (f" in {where}" if where else "") + f": {result.get('message')}")


COURSE = re.compile(r"#\s*course(:|\s*$)")   # a `# course` comment: the course's plumbing, not DDP


def course_line(line):
    """True for a line whose comment is `# course` or starts `# course:`: the course's own
    plumbing (timing, the logs its checks read), which a learner's own script does not need."""
    return bool(COURSE.search(line))


def script_diff(old, new, context=1, course=True):
    """Unified diff lines from the reference script `old` (a shipped script's name, bundled.script)
    to the file `new`. course=False leaves out the `# course` lines of both before comparing."""
    a = script(old).read_text().splitlines()
    b = Path(new).read_text().splitlines()
    if not course:
        a = [line for line in a if not course_line(line)]
        b = [line for line in b if not course_line(line)]
    return unified_diff(a, b, old, str(new), context)


def unified_diff(a, b, old, new, context=1):
    """difflib.unified_diff's lines, matched without difflib's autojunk: from 200 lines on, that
    takes lines seen often, such as blank ones, for junk, and the diff shows needless changes."""
    def span(start, stop):   # a hunk's range, in unified diff's 1-based `start,length`
        return f"{start + 1}" if stop - start == 1 else f"{start + (stop > start)},{stop - start}"
    out = []
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        out += [f"--- {old}", f"+++ {new}"] if not out else []
        out.append(f"@@ -{span(group[0][1], group[-1][2])} +{span(group[0][3], group[-1][4])} @@")
        for tag, i1, i2, j1, j2 in group:
            out += [" " + line for line in a[i1:i2]] if tag == "equal" else []
            out += ["-" + line for line in a[i1:i2]] if tag in ("replace", "delete") else []
            out += ["+" + line for line in b[j1:j2]] if tag in ("replace", "insert") else []
    return out


def show_diff(old, new, context=1, course=True, fold=None):
    """The lesson is the diff: print what changed from the previous lesson's script.
    course=False hides the lines marked `# course` of both scripts and says how many of each it
    hid; it lists the ones of `old` that `new` no longer has, which the diff then does not show.
    fold="a summary line" shows the same text in a closed fold instead, as show_script does."""
    text = "\n".join(script_diff(old, new, context, course))
    if not course:
        ours = [line.strip() for line in script(old).read_text().splitlines() if course_line(line)]
        theirs = [line.strip() for line in Path(new).read_text().splitlines() if course_line(line)]
        gone = list((Counter(ours) - Counter(theirs)).elements())
        name = Path(new).name
        text += (f"\n\n(Lines marked `# course` left out: {len(ours)} of {old}'s, {len(theirs)} of "
                 f"{name}'s. They are the course's own timing and logging; the scripts have them all.)")
        if gone:   # dropped by `new`: the diff above cannot show them, so they are named here
            these = "This `# course` line of" if len(gone) == 1 else f"These {len(gone)} `# course` lines of"
            verb = "is" if len(gone) == 1 else "are"
            text += f"\n{these} {old} {verb} not in {name}:\n" + "\n".join("    " + line for line in gone)
    _print_or_fold(text, fold)


def show_script(path, course=True, fold=None):
    """Print the script file `path` whole, such as script("ddp_basic.py"). course=False leaves
    out the lines marked `# course` and says how many it left out. fold="a summary line" shows
    the same text in a closed fold instead, an HTML <details> that a click opens (frontends
    without HTML get the plain text)."""
    every = Path(path).read_text().splitlines()
    shown = every if course else [line for line in every if not course_line(line)]
    text = "\n".join(shown)
    if not course:
        hidden = len(every) - len(shown)
        text += (f"\n\n(Lines marked `# course` left out: {hidden}. They are the course's own timing "
                 f"and logging; the script has them all, and show_script without course=False prints them.)")
    _print_or_fold(text, fold)


def _print_or_fold(text, fold):
    """Print `text`, or, given a summary line `fold`, display it in a closed HTML <details> that
    a click opens; frontends without HTML get the plain text."""
    if fold is None:
        print(text)
        return
    from IPython.display import display
    display({"text/plain": text,
             "text/html": f"<details><summary>{html.escape(fold)}</summary><pre>{html.escape(text)}</pre></details>"},
            raw=True)


def show(fig):
    """Display a figure as a PNG once and close it (pyplot or not), so nothing is shown twice."""
    from IPython.display import Image, display

    from . import plots

    display(Image(data=plots.to_png(fig)))
    pyplot = sys.modules.get("matplotlib.pyplot")   # a figure from pyplot is also in its list
    if pyplot is not None:
        pyplot.close(fig)
