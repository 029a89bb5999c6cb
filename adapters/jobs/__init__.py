"""Jobs and trials (docs/SPEC.md §13, §18), and Harbor's job folders both ways.

    queue.py         `JobRunner`: works one job's queue, `-n` trials at a time
    trial.py         one trial: its attempts, recovery and lease
    jobform.py       which job a `job run` names, and where its tasks are (ours, Harbor's)
    harbor.py        a Harbor job folder imported (its verdicts against ours)
    harborexport.py  a job exported as Harbor writes one (result.json, ATIF, cost)
    harborjob.py     the job's and trials' config.json and the job's result.json

Nothing is imported here: each module is imported by name.
"""
