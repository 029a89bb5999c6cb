#!/bin/sh
cat seed.txt >> notes.txt
