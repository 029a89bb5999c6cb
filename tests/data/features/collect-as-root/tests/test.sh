#!/bin/sh
if [ "$(cat /root/hook-uid 2>/dev/null)" = 0 ] && [ "$(cat /root/answer-owner 2>/dev/null)" = nobody ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
