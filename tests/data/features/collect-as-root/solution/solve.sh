#!/bin/sh
touch /tmp/answer
