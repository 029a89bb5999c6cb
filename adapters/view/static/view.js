// trialledger view: sortable tables, and the sessions filters in an exported page (a
// server filters on its own). Reads only the page; sends nothing anywhere.
"use strict";

function cellValue(row, index) {
  const cell = row.cells[index];
  if (!cell) return "";
  const raw = cell.getAttribute("data-value");
  if (raw !== null) {
    try { const v = JSON.parse(raw); return v === null ? -Infinity : v; } catch (e) { return raw; }
  }
  const text = cell.textContent.trim();
  const n = Number(text);
  return text !== "" && !Number.isNaN(n) ? n : text;
}

function sortBy(table, index, th) {
  const body = table.tBodies[0];
  const ascending = th.getAttribute("data-sorted") !== "asc";
  const rows = Array.from(body.rows);
  rows.sort((a, b) => {
    const x = cellValue(a, index), y = cellValue(b, index);
    const order = typeof x === "number" && typeof y === "number" ? x - y
      : String(x).localeCompare(String(y));
    return ascending ? order : -order;
  });
  for (const other of table.tHead.rows[0].cells) other.removeAttribute("data-sorted");
  th.setAttribute("data-sorted", ascending ? "asc" : "desc");
  for (const row of rows) body.appendChild(row);
}

function filterRows(table, params) {
  let shown = 0;
  for (const row of table.tBodies[0].rows) {
    let keep = true;
    for (const [name, wanted] of params) {
      if (!wanted) continue;
      const have = row.getAttribute("data-" + name) || "";
      if (name === "gap") keep = keep && have.split(" ").includes(wanted);
      else if (name === "id") keep = keep && have.split(" ").some((id) => id.startsWith(wanted));
      else keep = keep && have === wanted;
    }
    row.hidden = !keep;
    if (keep) shown += 1;
  }
  const count = document.getElementById("shown");
  if (count) count.textContent = String(shown);
}

document.addEventListener("DOMContentLoaded", () => {
  for (const table of document.querySelectorAll("table.sortable")) {
    const head = table.tHead.rows[0];
    Array.from(head.cells).forEach((th, index) => {
      th.addEventListener("click", () => sortBy(table, index, th));
    });
  }
  if (document.body.getAttribute("data-static") === "1") {
    const params = new URLSearchParams(location.search);
    const wanted = ["result", "task", "outcome", "rule", "gap", "model", "id"].map((n) => [n, params.get(n) || ""]);
    for (const [name, value] of wanted) {
      const field = document.getElementById("f-" + name);
      if (field && value) field.value = value;
    }
    for (const table of document.querySelectorAll("table.filterable")) filterRows(table, wanted);
  }
});
