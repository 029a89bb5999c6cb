#!/bin/sh
cat data/more.txt >> out.txt
