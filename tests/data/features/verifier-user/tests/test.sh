#!/bin/sh
if [ "$(id -un)" = nobody ] && grep -qx hello /tmp/greeting 2>/dev/null; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
