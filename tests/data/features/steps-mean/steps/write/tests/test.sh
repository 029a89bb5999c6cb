#!/bin/sh
if grep -qx one notes.txt 2>/dev/null; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
