#!/bin/sh
if [ "$(cat /tmp/agent-uid 2>/dev/null)" = 0 ] && [ -f /root/by-the-agent ] && [ "$(id -un)" = agent ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
