#!/bin/sh
if grep -qx 42 /srv/snap/state 2>/dev/null && [ ! -e /srv/state ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
