"""The exercise graders: each exercise's checker, and the one verdict they print, "correct!" or
"not yet:".

One module per notebook with an exercise, named by the notebook's number: lNN.py grades
notebooks/NN_*.ipynb (l03b.py grades 03b; 03c has no module, see below). What they share
(`attempt`, `grade`, `finished`) is common.py:

    from ddp_lesson.notebook.graders import common, l00, l03
    run_dir, passed = common.attempt("work/ex_set_epoch.py", l03.check_set_epoch)   # launch, wait, grade
    passed = common.grade(l00.check_cuda_index, cuda_index)                          # a function you wrote

A check_* raises AssertionError with one sentence saying what is wrong, or returns True or a
line saying what it saw. Launched exercises (03-05, 11): the checker reads a finished run
directory (config.json and the ranks' metrics; check_no_sync also the learner's prediction);
expectations come from the run's own world size. Pure-function exercises (00-04, 06-08, 10):
the checker calls the learner's function on cases, in this process. 09's check_bucketed grades
ddp_scratch.check_stage's result and returns (ok, why). 03c's check_rank_loss stays in its
notebook (it runs that notebook's own functions) and is graded by `grade`.

Not here: number validation (launcher/validate.py), the launched check scripts
(rank/scripts/checks/, started by lesson.check()), and the checks of a lesson's own runs and
claims (capstone.py, syncbn_compare.py).
"""
