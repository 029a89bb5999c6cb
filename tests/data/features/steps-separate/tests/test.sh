#!/bin/sh
# the last step: both steps' work, made in the one container the steps share
if [ "$(cat /srv/out.txt 2>/dev/null)" = "$(printf 'alpha\nbeta')" ] && [ ! -e /srv/undeclared.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
