#!/bin/sh
echo 42 > /srv/state
