#!/bin/sh
echo one > notes.txt
