#!/bin/sh
echo 42 > /srv/out.txt
