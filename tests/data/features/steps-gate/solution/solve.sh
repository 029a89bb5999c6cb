#!/bin/sh
echo ok > checked.txt
