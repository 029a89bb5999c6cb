#!/bin/bash
# The expected answer comes from the verifier's own `answers` service, which the agent's
# container never had.
exec 3<>/dev/tcp/answers/8080
printf 'GET /answer HTTP/1.0\r\n\r\n' >&3
expected=$(sed '1,/^\r$/d' <&3)
if [ -n "$expected" ] && [ "$(cat /srv/out.txt 2>/dev/null)" = "$expected" ]; then
    echo 1; else echo 0; fi > /logs/verifier/reward.txt
