#!/bin/sh
# the final step: both steps' work, in one container; the first step's data/ and its setup kept
if [ "$(cat out.txt 2>/dev/null)" = "$(printf 'alpha\nbeta')" ] && [ -f data/seed.txt ] && grep -qx set prepared.txt; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
