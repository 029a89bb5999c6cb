#!/bin/bash
if grep -qx "hello-ordered-compose from /srv as 0, prepared, templated" /app/greeting.txt \
        2>/dev/null && grep -qx prepared /mnt/notes/note; then
    echo 1; else echo 0; fi > /logs/verifier/reward.txt
