#!/bin/sh
if [ -f built.txt ] && grep -qx ok checked.txt 2>/dev/null; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
