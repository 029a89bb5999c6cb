#!/bin/sh
# graded apart, in this step's own image: the declared artifact, nothing else of the agent's
if [ "$(cat /srv/out.txt 2>/dev/null)" = "$(printf 'alpha\nbeta')" ] && [ ! -e /srv/note.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
