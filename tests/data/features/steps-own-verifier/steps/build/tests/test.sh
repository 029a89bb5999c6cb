#!/bin/sh
# shared: the verifier runs in the agent's container and sees everything it wrote
if grep -qx alpha /srv/out.txt 2>/dev/null && [ -f /srv/note.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
