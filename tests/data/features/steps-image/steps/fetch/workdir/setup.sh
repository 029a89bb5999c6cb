#!/bin/sh
# run in the workdir, as the agent user, before the step's agent
echo set > prepared.txt
