#!/bin/sh
if [ -f built.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
