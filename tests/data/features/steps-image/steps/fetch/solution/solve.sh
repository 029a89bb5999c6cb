#!/bin/sh
cp data/seed.txt out.txt
