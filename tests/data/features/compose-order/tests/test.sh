#!/bin/bash
if grep -qx "hello-ordered-compose from /srv as 0" /app/greeting.txt 2>/dev/null; then
    echo 1; else echo 0; fi > /logs/verifier/reward.txt
