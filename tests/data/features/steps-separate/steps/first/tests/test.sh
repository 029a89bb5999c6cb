#!/bin/sh
# graded apart: the declared artifact is here, nothing else the agent wrote
if grep -qx alpha /srv/out.txt 2>/dev/null && [ ! -e /srv/undeclared.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
