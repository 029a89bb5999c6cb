#!/bin/sh
echo alpha > /srv/out.txt
echo mine > /srv/note.txt
