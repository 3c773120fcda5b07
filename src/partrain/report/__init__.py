"""Reports: plots of benchmark results (``plots``), Chrome traces and Gantt charts of runs (``trace``, ``gantt``,
``timeline_html``), and the self-contained HTML report (``html``, ``page``, ``cached``)."""
